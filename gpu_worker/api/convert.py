"""Generation API wire messages <-> engine types. The only worker module besides the servicer
that imports generated protobuf code."""

from __future__ import annotations

from gpu_worker.engine.admission import GenerationInput
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import effective_temperature
from hybridserve.structured_output import StructuredSpec
from hybridserve.v1 import generation_pb2 as pb


def generation_input_from_pb(msg: pb.GenerateRequest) -> GenerationInput:
    """Copies the request's fields; validation happens in admission (build_request). A temperature below
    GREEDY_BELOW_TEMPERATURE arrives as 0 (greedy): hybridserve.generation_config says why."""
    kind = msg.WhichOneof("input")
    s = msg.sampling
    return GenerationInput(
        request_id=msg.request_id,
        prompt=msg.prompt if kind == "prompt" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if kind == "prompt_token_ids" else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=effective_temperature(s.temperature) if s.HasField("temperature") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        priority=msg.priority,
        add_special_tokens=msg.add_special_tokens if msg.HasField("add_special_tokens") else True,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        min_p=s.min_p,
        logit_bias=tuple(s.logit_bias.items()),
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        cache_salt=msg.cache_salt,
        structured=structured_spec_from_pb(s.structured_output) if s.HasField("structured_output") else None,
    )


def structured_spec_from_pb(msg: pb.StructuredOutput) -> StructuredSpec:
    """The spec of a StructuredOutput; one with no kind set is INVALID_ARGUMENT."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError(
            "sampling.structured_output sets no kind; set one of json_schema, json_object, regex, choice, grammar"
        )
    if kind == "json_object":
        return StructuredSpec("json_object", "", msg.any_whitespace)
    if kind == "choice":
        return StructuredSpec.choices(tuple(msg.choice.values))
    return StructuredSpec(kind, getattr(msg, kind), msg.any_whitespace)
