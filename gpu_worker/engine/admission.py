"""Turns what a client asked for into an engine Request, rejecting what can never be served.

The wire message is converted first (gpu_worker/api/convert.py); nothing here knows protobuf.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from gpu_worker.engine.grammar import GrammarCompiler
from gpu_worker.engine.request import GenerationParams, Request, StopChecker
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner.protocol import MAX_LOGIT_BIAS_TOKENS, Runner, SamplingParams
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import GenerationDefaults
from hybridserve.structured_output import StructuredSpec

# Documented limits of one request (README, "Limits of one request").
MAX_TOP_LOGPROBS = 20  # sampling.logprobs: top alternatives per token
MAX_STOP_STRINGS = 16  # sampling.stop: strings per request (each is searched for at every token)
MAX_STOP_STRING_CHARS = 256  # characters in one stop string
MAX_REQUEST_ID_CHARS = 256  # request_id
MAX_CACHE_SALT_CHARS = 256  # cache_salt
MAX_TEMPERATURE = 100.0  # sampling.temperature; beyond it sampling is uniform in all but name
MAX_STOP_TOKEN_IDS = 64  # sampling.stop_token_ids
GENERATION_API_SAMPLING = (0.0, 1.0, 0)  # (temperature, top_p, top_k) unset here and in the checkpoint: greedy


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """A generation request as the client sent it, before validation."""

    request_id: str  # "" = the worker picks one
    prompt: str | None  # text, or None when prompt_token_ids is given
    prompt_token_ids: tuple[int, ...] | None  # None when prompt is given; both None = neither was set
    max_tokens: int | None  # None = the worker's default; 0 = no new tokens (the prompt is read)
    # None = unset: the checkpoint's generation_config value, else greedy / off (hybridserve.generation_config)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None  # 0 = off (1.0)
    seed: int | None = None
    logprobs: int = 0  # top alternatives per token
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's special tokens (false: it holds them)
    # the sampling controls (gpu_worker.runner.sampling.SamplingParams); unset = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None = 1 (off)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None  # None = not asked; 0 = each prompt token's log-probability
    cache_salt: str = ""  # requests of different salts share no prefix-cache block; "" = unsalted
    structured: StructuredSpec | None = None  # the grammar the output must match (structured outputs)


@dataclass(frozen=True, slots=True)
class ModelLenLimit:
    """The most tokens (prompt + max_tokens) one request may have, and why."""

    tokens: int
    source: str  # e.g. "max_position_embeddings of config.json (the KV pool holds 250000)"


def model_len_limit(asked: int, max_position_embeddings: int, pool_tokens: int) -> ModelLenLimit:
    """`--max-model-len` when given (`asked` > 0); else the checkpoint's `max_position_embeddings`, capped by
    what the KV pool holds (`pool_tokens`); the pool alone when the checkpoint names no length.

    A request needs its whole context in KV pages at once, so an asked limit above the pool is refused
    (InvalidArgumentError, at start-up): a request that long could never run, and capping it silently
    would hide the misconfiguration. An asked limit above max_position_embeddings is served (hybrids'
    Mamba layers and NoPE attention carry no position table; the limit is the user's call), and its
    source says so. The activation budget does not bound a prompt: prompts are computed in chunks of at
    most max_num_batched_tokens, the step the budget was profiled for."""
    if pool_tokens <= 0:
        raise InvalidArgumentError(f"the KV pool holds no tokens ({pool_tokens})")
    if asked > pool_tokens:
        raise InvalidArgumentError(
            f"--max-model-len {asked} exceeds the {pool_tokens} tokens the KV pool holds; lower --max-model-len or"
            " give the pools more memory (--gpu-memory-utilization, --memory-budget-mb)"
        )
    if asked > 0:
        above = 0 < max_position_embeddings < asked
        return ModelLenLimit(
            asked, f"--max-model-len (above max_position_embeddings {max_position_embeddings})" if above
            else "--max-model-len",
        )  # fmt: skip
    if 0 < max_position_embeddings <= pool_tokens:
        return ModelLenLimit(max_position_embeddings, f"max_position_embeddings (the KV pool holds {pool_tokens})")
    if max_position_embeddings > pool_tokens:
        return ModelLenLimit(pool_tokens, f"the KV pool (max_position_embeddings {max_position_embeddings})")
    return ModelLenLimit(pool_tokens, "the KV pool (config.json names no max_position_embeddings)")


def max_model_len_limit(runner: Runner, settings: EngineSettings) -> ModelLenLimit:
    """This worker's limit (see model_len_limit)."""
    pool_tokens = runner.pools.kv_pool.num_pages * runner.pools.kv_page_size_tokens
    return model_len_limit(settings.max_model_len, runner.config.max_position_embeddings, pool_tokens)


def max_model_len(runner: Runner, settings: EngineSettings) -> int:
    """Prompt plus generated tokens one request may reach (see model_len_limit)."""
    return max_model_len_limit(runner, settings).tokens


def build_request(
    asked: GenerationInput,
    runner: Runner,
    settings: EngineSettings,
    time_remaining_s: float | None,
    grammars: GrammarCompiler | None = None,
) -> Request:
    """The engine request of `asked`; InvalidArgumentError for what can never be served. A structured
    output is compiled here (`grammars`: the engine's compiler), so that a spec the engine cannot compile
    fails the call at once."""
    loaded = runner.loaded
    limit = max_model_len(runner, settings)
    if len(asked.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgumentError(
            f"request_id has {len(asked.request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    if len(asked.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgumentError(
            f"cache_salt has {len(asked.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed"
        )
    # cheap checks first: a bad request is refused before tokenising
    params = _params(asked, settings, loaded.generation_defaults, loaded.config.vocab_size, runner.eos_token_ids)
    prompt = _prompt_ids(asked, loaded, limit)
    if len(prompt) + params.max_tokens > limit:
        raise InvalidArgumentError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds this worker's"
            f" limit of {limit} tokens; shorten the prompt or lower max_tokens"
        )
    grammar = None
    if asked.structured is not None:
        if grammars is None:
            raise InvalidArgumentError("structured_output is not served by this engine")
        grammar = grammars.compile(asked.structured)
    now = time.monotonic()
    return Request(
        grammar=grammar,
        request_id=asked.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        params=params,
        arrival_time=now,
        deadline=None if time_remaining_s is None else now + time_remaining_s,
        stop_checker=StopChecker(loaded.tokenizer, params.stop),
        cache_salt=asked.cache_salt,
    )


def max_prompt_bytes(loaded: LoadedModel, limit_tokens: int) -> int:
    """The longest text prompt (UTF-8 bytes) that could tokenise to `limit_tokens` tokens: longer
    ones are refused before tokenising (tokenising tens of MB takes seconds and GBs)."""
    return limit_tokens * (loaded.tokenizer.max_bytes_per_token if loaded.tokenizer is not None else 0)


def _check_prompt_size(text: str, loaded: LoadedModel, limit_tokens: int) -> None:
    most = max_prompt_bytes(loaded, limit_tokens)
    # a character is at least one byte: the length in characters refuses a huge prompt in O(1)
    size = len(text) if len(text) > most else len(text.encode("utf-8", "surrogatepass"))
    if size > most:
        raise InvalidArgumentError(
            f"the prompt is {size} bytes; this worker takes at most {limit_tokens} tokens, so at most {most} bytes"
            " of text with this tokenizer; shorten the prompt"
        )


def _prompt_ids(asked: GenerationInput, loaded: LoadedModel, limit_tokens: int) -> list[int]:
    if asked.prompt is not None:
        if loaded.tokenizer is None:
            raise InvalidArgumentError(
                "this model has no tokenizer.json; send prompt_token_ids instead of a text prompt"
            )
        _check_prompt_size(asked.prompt, loaded, limit_tokens)
        ids = loaded.tokenizer.encode(asked.prompt, add_special_tokens=asked.add_special_tokens)
    elif asked.prompt_token_ids is not None:
        ids = list(asked.prompt_token_ids)
        if len(ids) > limit_tokens:
            raise InvalidArgumentError(
                f"prompt_token_ids holds {len(ids)} tokens; this worker's limit is {limit_tokens}; shorten the prompt"
            )
        vocab = loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab})")
    else:
        raise InvalidArgumentError("set either prompt (text) or prompt_token_ids")
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    return ids


def _params(
    s: GenerationInput, settings: EngineSettings, defaults: GenerationDefaults, vocab: int, eos: tuple[int, ...]
) -> GenerationParams:
    if s.max_tokens is not None and s.max_tokens < 0:
        raise InvalidArgumentError(
            f"sampling.max_tokens must be >= 0 (0 = no new tokens; unset = the default), got {s.max_tokens}"
        )
    if not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(f"sampling.logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {s.logprobs}")
    _check_stop(s.stop)
    if s.temperature is not None and not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE):
        raise InvalidArgumentError(
            f"sampling.temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {s.temperature}"
        )
    if s.top_p is not None and not (math.isfinite(s.top_p) and 0.0 <= s.top_p <= 1.0):
        raise InvalidArgumentError(f"sampling.top_p must be a number in [0, 1] (0 or 1 = off), got {s.top_p}")
    max_tokens = settings.default_max_tokens if s.max_tokens is None else s.max_tokens
    _check_controls(s, vocab, max_tokens)
    temperature, top_p, top_k = defaults.sampling(s.temperature, s.top_p, s.top_k, fallback=GENERATION_API_SAMPLING)
    stop_ids = tuple(dict.fromkeys(s.stop_token_ids))
    held = tuple(dict.fromkeys(stop_ids + eos)) if s.min_tokens else ()
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=1.0 if top_p == 0 else top_p,
            seed=s.seed,
            num_logprobs=s.logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
            min_p=s.min_p,
            logit_bias=tuple(sorted(s.logit_bias)),
            min_tokens=s.min_tokens,
            held_token_ids=held,
        )
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"sampling.{exc}") from None
    return GenerationParams(
        sampling=sampling,
        max_tokens=max_tokens,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        priority=s.priority,
        stop_token_ids=frozenset(stop_ids),
        prompt_logprobs=s.prompt_logprobs is not None,
    )


def _check_controls(s: GenerationInput, vocab: int, max_tokens: int) -> None:
    """The sampling controls' ranges and ids (SamplingParams checks its own ranges again, for its other
    callers); each error names the field."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidArgumentError(f"sampling.{name} must be in [-2, 2] (0 = off), got {value}")
    if s.repetition_penalty is not None and not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise InvalidArgumentError(f"sampling.repetition_penalty must be > 0 (1 = off), got {s.repetition_penalty}")
    if not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
        raise InvalidArgumentError(f"sampling.min_p must be in [0, 1] (0 = off), got {s.min_p}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgumentError(
            f"sampling.logit_bias holds {len(s.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are allowed"
        )
    for token, bias in s.logit_bias:
        if not 0 <= token < vocab:
            raise InvalidArgumentError(f"sampling.logit_bias names token {token}, outside the vocabulary [0, {vocab})")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidArgumentError(f"sampling.logit_bias of token {token} must be in [-100, 100], got {bias}")
    if not 0 <= s.min_tokens <= max_tokens:
        raise InvalidArgumentError(f"sampling.min_tokens must be in [0, max_tokens ({max_tokens})], got {s.min_tokens}")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(
            f"sampling.stop_token_ids holds {len(s.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        )
    bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgumentError(f"sampling.stop_token_ids holds {bad}, outside the vocabulary [0, {vocab})")
    if s.prompt_logprobs is not None and s.prompt_logprobs != 0:
        raise InvalidArgumentError(
            f"sampling.prompt_logprobs must be 0 (each prompt token's log-probability), got {s.prompt_logprobs}:"
            " top alternatives of prompt tokens are not supported yet"
        )


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for text in stop:
        if not text:
            raise InvalidArgumentError("sampling.stop holds an empty string; remove it")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidArgumentError(
                f"a sampling.stop string has {len(text)} characters; at most {MAX_STOP_STRING_CHARS} are allowed"
            )
