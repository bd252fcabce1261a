"""An OpenAI request -> the worker's GenerateRequest, one per choice. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.openai_request import ApiRequest
from hybridserve.v1 import generation_pb2 as pb

SEED_MASK = (1 << 63) - 1


def sampling_of(api: ApiRequest, choice_index: int) -> pb.SamplingParams:
    """Choice i samples with seed + i, so n seeded choices differ from each other and each repeats."""
    sampling = pb.SamplingParams(
        temperature=api.temperature,
        top_p=api.top_p,
        top_k=max(api.top_k, 0),
        max_tokens=api.max_tokens,
        stop=list(api.stop),
        ignore_eos=api.ignore_eos,
        logprobs=api.top_logprobs,
    )
    if api.seed is not None:
        sampling.seed = (api.seed + choice_index) & SEED_MASK if choice_index else api.seed
    return sampling


def generate_requests(api: ApiRequest, prompt: str | Sequence[int]) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice; `prompt` is the text, or the token ids when the gateway has
    tokenized it (or the client sent ids)."""
    requests = []
    for i in range(api.n):
        request = pb.GenerateRequest(sampling=sampling_of(api, i))
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        requests.append(request)
    return requests
