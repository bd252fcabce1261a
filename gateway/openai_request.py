"""The OpenAI request bodies, validated into one frozen `ApiRequest`. Pure: JSON in, dataclass out,
`ApiError` (400) with the offending field named for anything else.

Fields we do not implement are refused (400 naming the field) unless they hold their no-op value
(`presence_penalty: 0`, `tools: []`, `echo: false`, ...), which some clients always send. Fields
OpenAI does not know are refused as OpenAI refuses them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.api_errors import bad_request, number_field, unsupported, utf8_text, wrong_type
from gateway.chat_messages import Message, parse_messages
from gateway.sampling_fields import CONTROL_FIELDS, SamplingControls, check_min_tokens, parse_controls
from gateway.structured import FIELDS as STRUCTURED_FIELDS
from gateway.structured import parse_structured
from gateway.tool_calls import ToolRequest, parse_tool_request
from hybridserve.structured_output import StructuredSpec

MAX_N = 16  # choices per prompt
MAX_BATCH_CHOICES = 128  # prompts x n of one completions request: the worker calls it fans out to
MAX_STOP = 4  # stop strings, as OpenAI
MAX_TOP_LOGPROBS = 20  # the workers' limit
OPENAI_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_CACHE_SALT_CHARS = 256  # as the workers allow
MAX_TOKEN_ID = 2**31  # token ids travel as int32; the worker checks them against its vocabulary

_COMMON = (
    frozenset(
        {
            "model",
            "stream",
            "stream_options",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "user",
            "logprobs",
            "top_k",
            "ignore_eos",
            "cache_salt",
            *STRUCTURED_FIELDS,
        }
    )
    | CONTROL_FIELDS
)
_COMPLETION = _COMMON | {"prompt", "echo"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}

# field -> values that mean "off" (accepted and ignored, since they change nothing)
_NO_OP: dict[str, tuple[Any, ...]] = {
    "echo": (False,),  # chat: the completions endpoint serves it (gateway/echo.py)
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}


@dataclass(frozen=True, slots=True)
class TextLimits:
    """How much text the served model can take: a text longer than max_model_len * max_bytes_per_token
    UTF-8 bytes cannot fit, and is refused before it is tokenized (tokenizing 16 MiB takes seconds)."""

    max_model_len: int  # tokens, the smallest of the ready workers' limits
    max_bytes_per_token: int  # UTF-8 bytes one token can stand for at most (gateway/tokens.py)

    @property
    def max_text_bytes(self) -> int:
        return self.max_model_len * self.max_bytes_per_token


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | tuple[int, ...]  # completions: (the first prompt's) text or token ids; chat: "" (from messages)
    messages: tuple[Message, ...]  # chat only
    max_tokens: int  # 0 = the worker's default
    # None = unset: the checkpoint's generation_config value, else OpenAI's default (gateway/convert.py)
    temperature: float | None  # 0 = greedy
    top_p: float | None  # 1 = off
    top_k: int | None  # 0 = off (an extension beside OpenAI's fields; -1 is read as 0)
    seed: int | None
    stop: tuple[str, ...]
    n: int  # choices
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    logprobs: bool  # return the chosen tokens' log-probabilities
    top_logprobs: int  # alternatives per token, 0..MAX_TOP_LOGPROBS
    ignore_eos: bool  # an extension: generate max_tokens even past EOS (benchmarks)
    controls: SamplingControls = SamplingControls()  # vLLM's sampling controls (gateway/sampling_fields.py)
    echo: bool = False  # completions: the prompt first in the text (and its log-probabilities first)
    # stream_options.continuous_usage_stats (vLLM's extension, which GuideLLM sends): every chunk carries its
    # choice's usage so far (prompt tokens, tokens generated up to and including the chunk)
    continuous_usage: bool = False
    # completions: every prompt of the request in order (a list of several); () = just `prompt`
    prompts: tuple[str | tuple[int, ...], ...] = ()
    cache_salt: str = ""  # vLLM's: requests of different salts share no prefix-cache block ("" = unsalted)
    structured: StructuredSpec | None = None  # response_format / structured_outputs (gateway/structured.py)
    tools: ToolRequest | None = None  # chat: the functions the model may call (gateway/tool_calls.py)

    @property
    def all_prompts(self) -> tuple[str | tuple[int, ...], ...]:
        """The prompts whose n choices each make up the response: prompt i's are choices i*n .. i*n+n-1."""
        return self.prompts or (self.prompt,)


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(name, "an integer", value)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}", name, "invalid_value")
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean", value)
    return value


def check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Refuses unimplemented fields (unless at their no-op value) and fields OpenAI does not know."""
    for name, value in body.items():
        if name in allowed:
            continue
        if name in _NO_OP:
            if value is None or value in _NO_OP[name]:
                continue
            raise unsupported(name)
        raise bad_request(f"unrecognized request argument supplied: '{name}'", name, "unknown_parameter")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise wrong_type("stop", "a string or a list of strings", value)
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' holds {len(stops)} strings; at most {MAX_STOP} are allowed", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' holds an empty string", "stop", "invalid_value")
    return tuple(utf8_text(s, "stop") for s in stops)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required; GET /v1/models lists the served model", "model", "missing_required")
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    return model


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    check_fields(options, frozenset({"include_usage", "continuous_usage_stats"}))
    _bool(options, "continuous_usage_stats", False)  # its type checked; read by _continuous_usage
    return _bool(options, "include_usage", False)


def _continuous_usage(body: Mapping[str, Any]) -> bool:
    """stream_options.continuous_usage_stats, as vLLM reads it: usage in every chunk, when include_usage is on
    too (otherwise there is no usage to report). _include_usage has checked the object."""
    options = body.get("stream_options")
    return bool(options and options.get("include_usage") and options.get("continuous_usage_stats"))


def _cache_salt(body: Mapping[str, Any]) -> str:
    """A non-empty string of at most MAX_CACHE_SALT_CHARS characters, or absent (vLLM refuses "" too)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise wrong_type("cache_salt", "a string", salt)
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
            "cache_salt",
            "invalid_value",
        )
    return utf8_text(salt, "cache_salt")


def _common(
    body: Mapping[str, Any],
    kind: str,
    prompt: str | tuple[int, ...],
    messages: tuple[Message, ...],
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
) -> ApiRequest:
    stream = _bool(body, "stream", False)
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    top_k = _int(body, "top_k", None, -1, 1 << 20)
    controls = parse_controls(body)
    check_min_tokens(controls, max_tokens)
    return ApiRequest(
        kind=kind,
        model=_model(body),
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 2.0),
        top_p=number_field(body, "top_p", 0.0, 1.0),
        top_k=None if top_k is None else max(top_k, 0),
        seed=seed,
        stop=_stop(body),
        n=_int(body, "n", 1, 1, MAX_N) or 1,
        stream=stream,
        include_usage=_include_usage(body, stream),
        continuous_usage=_continuous_usage(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        controls=controls,
        echo=kind == "completion" and _bool(body, "echo", False),
        cache_salt=_cache_salt(body),
        structured=parse_structured(body),
    )


def _is_token_ids(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(value: Any, name: str) -> str | tuple[int, ...]:
    """One prompt: non-empty text, or a non-empty list of token ids (`name` says which in a batch)."""
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{name}' is empty", "prompt", "invalid_value")
        return utf8_text(value, "prompt")
    if _is_token_ids(value):
        bad = next((t for t in value if not 0 <= t < MAX_TOKEN_ID), None)
        if bad is not None:
            raise bad_request(f"'{name}' holds the token id {bad}, not a valid id", "prompt", "invalid_value")
        return tuple(value)
    raise bad_request(
        f"'{name}' must be a string or a non-empty list of token ids, got {type(value).__name__} {value!r:.60}",
        "prompt",
        "invalid_type",
    )


def _prompts(body: Mapping[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four shapes of `prompt`: a string, a list of token ids (one prompt each), a list of
    strings, a list of token-id lists (several prompts, one after the other in the choices)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return (_one_prompt(prompt, "prompt"),)
    if (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt))
    ):
        if len(prompt) > MAX_BATCH_CHOICES:
            raise bad_request(
                f"'prompt' holds {len(prompt)} prompts; this server takes at most {MAX_BATCH_CHOICES} in one"
                " request: split the batch",
                "prompt",
            )
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    raise wrong_type("prompt", "a string, a list of token ids, a list of strings or a list of token-id lists", prompt)


def parse_completion(body: Any) -> ApiRequest:
    """POST /v1/completions."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, _COMPLETION)
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo", False)  # with echo, max_tokens 0 scores the prompt alone (lm-eval)
    max_tokens = _int(body, "max_tokens", OPENAI_COMPLETION_DEFAULT_MAX_TOKENS, 0 if echo else 1, 1 << 30)
    prompts = _prompts(body)
    api = _common(body, "completion", prompts[0], (), max_tokens or 0, logprobs is not None, logprobs or 0)
    if len(prompts) * api.n > MAX_BATCH_CHOICES:
        raise bad_request(
            f"{len(prompts)} prompts x 'n' {api.n} make {len(prompts) * api.n} choices; this server makes at most"
            f" {MAX_BATCH_CHOICES} in one request: lower 'n' or split the batch",
            "n",
        )
    return replace(api, prompts=prompts) if len(prompts) > 1 else api


def parse_chat(body: Any) -> ApiRequest:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, _CHAT)
    max_tokens = _int(body, "max_completion_tokens", None, 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 0, 1, 1 << 30)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    api = _common(body, "chat", "", parse_messages(body), max_tokens or 0, logprobs, top)
    tools = parse_tool_request(body)
    check_one_constraint(body, api.structured, tools)
    return replace(api, tools=tools)


def check_one_constraint(body: Mapping[str, Any], structured: StructuredSpec | None, tools: ToolRequest | None) -> None:
    """Refuses a structured output beside a forced tool call: each constrains generation with a grammar
    of its own, and a worker request carries one."""
    if structured is None or tools is None or not tools.is_forced:
        return
    field = next(f for f in STRUCTURED_FIELDS if body.get(f) is not None)
    raise bad_request(
        f"'{field}' and 'tool_choice' ({'required' if tools.choice == 'required' else 'a named function'}) both"
        f" constrain the output, and only one can; drop '{field}', or let the model choose with 'tool_choice':"
        " 'auto'",
        field,
    )


def check_prompt_size(api: ApiRequest, limits: TextLimits) -> None:
    """Refuses a prompt that cannot fit the model: token ids beyond max_model_len, or text (a chat's
    contents together) beyond `limits.max_text_bytes`; each prompt of a batch on its own. The length in
    characters decides in O(1) when it alone is over (a character is at least one byte)."""
    if api.kind == "chat":
        check_text_size([m.content for m in api.messages], "messages", limits)
        return
    for prompt in api.all_prompts:
        if isinstance(prompt, str):
            check_text_size([prompt], "prompt", limits)
        elif len(prompt) > limits.max_model_len:
            raise bad_request(
                f"'prompt' holds {len(prompt)} token ids; this server takes at most {limits.max_model_len}",
                "prompt",
                "context_length_exceeded",
            )


def check_text_size(texts: Sequence[str], name: str, limits: TextLimits) -> None:
    """Refuses texts whose UTF-8 bytes together exceed `limits.max_text_bytes`, naming the limit."""
    most = limits.max_text_bytes
    num_chars = sum(len(t) for t in texts)
    size = num_chars if num_chars > most else sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > most:
        raise bad_request(
            f"'{name}' is {size} bytes of text; this server takes at most {limits.max_model_len} tokens, so at"
            f" most {most} bytes ({limits.max_bytes_per_token} bytes per token at most with this tokenizer);"
            " shorten the prompt",
            name,
            "context_length_exceeded",
        )
