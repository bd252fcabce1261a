"""An OpenAI request -> the worker's GenerateRequest, one per choice. Pure.

Sampling fields the request leaves unset take the checkpoint's generation_config.json values, else OpenAI's
defaults (hybridserve.generation_config states the rule); the gateway sends them all explicitly."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.openai_request import ApiRequest
from gateway.sampling_fields import fill_sampling
from gateway.structured import structured_output_pb
from hybridserve.generation_config import GenerationDefaults
from hybridserve.v1 import generation_pb2 as pb

SEED_MASK = (1 << 63) - 1
OPENAI_SAMPLING = (1.0, 1.0, 0)  # (temperature, top_p, top_k) OpenAI samples with when nothing says otherwise


def sampling_of(api: ApiRequest, choice_index: int, defaults: GenerationDefaults) -> pb.SamplingParams:
    """Choice i samples with seed + i, so n seeded choices differ from each other and each repeats."""
    temperature, top_p, top_k = defaults.sampling(api.temperature, api.top_p, api.top_k, fallback=OPENAI_SAMPLING)
    sampling = pb.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        # 0 is the worker's default (unset), except with echo, where it asks for the prompt alone
        max_tokens=api.max_tokens if api.max_tokens or api.echo else None,
        prompt_logprobs=0 if api.echo and api.logprobs else None,
        stop=list(api.stop),
        ignore_eos=api.ignore_eos,
        logprobs=api.top_logprobs,
    )
    fill_sampling(api.controls, sampling)
    if api.structured is not None:
        sampling.structured_output.CopyFrom(structured_output_pb(api.structured))
    if api.seed is not None:
        sampling.seed = (api.seed + choice_index) & SEED_MASK if choice_index else api.seed
    return sampling


def generate_requests(
    api: ApiRequest, prompt: str | Sequence[int], defaults: GenerationDefaults | None = None
) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice; `prompt` is the text, or the token ids when the gateway has
    tokenized it (or the client sent ids). A chat prompt's text is the rendered template, which holds its
    special tokens: the worker is told to add none."""
    defaults = defaults if defaults is not None else GenerationDefaults()
    requests = []
    for i in range(api.n):
        request = pb.GenerateRequest(sampling=sampling_of(api, i, defaults), cache_salt=api.cache_salt)
        if isinstance(prompt, str):
            request.prompt = prompt
            if api.kind == "chat":
                request.add_special_tokens = False
        else:
            request.prompt_token_ids.ids.extend(prompt)
        requests.append(request)
    return requests
